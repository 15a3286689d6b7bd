"""The remote runtime: `lightning worker` processes run the agent in their own environment. The server side is
the collector (`collect`), the book of work (`dispatch`) and the HTTP routes (`routes`); the worker side is
`worker`; both speak `protocol`. Importing the package imports none of them (a worker's environment is light)."""
