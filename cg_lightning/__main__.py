"""``python -m cg_lightning fit|validate|test|predict --config FILE.yaml [--key=value ...]``."""

import cg_lightning  # noqa: F401  (importing the package registers the "cudagraph_ddp" strategy)
from cg_lightning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
