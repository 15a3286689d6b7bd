"""`lightning worker ...` in a process that, when the worker has ended, prints which heavy or server-side modules
it imported: a worker's environment must not need them (tests/test_remote_worker.py)."""

import json
import sys

from lightning_sdk.cli import main

HEAVY = ("torch", "transformers", "peft", "fastapi", "uvicorn", "starlette", "lightning_sdk.store",
         "lightning_sdk.servers", "lightning_sdk.train", "lightning_sdk.runtime")

code = 0
try:
    main(sys.argv[1:], standalone_mode=False)
except SystemExit as e:
    code = e.code or 0
finally:
    print("IMPORTED " + json.dumps(sorted({m for m in sys.modules if m.startswith(HEAVY)})), flush=True)
sys.exit(code)
