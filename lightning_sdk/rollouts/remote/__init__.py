"""The remote runtime: `lightning worker` processes run the agent in their own environment. The server side is
the collector (`collect`), the book of work (`dispatch`), the HTTP routes (`routes`) and OTLP decoding (`otlp`);
the worker side is `worker` with its span outlet (`ship`); both speak `protocol`. Importing the package imports none of them (a worker's environment is light)."""
