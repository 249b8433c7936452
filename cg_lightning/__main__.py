"""``python -m cg_lightning fit|validate|test|predict --config FILE.yaml [--key=value ...]``.

OpenMP threads wait by sleeping, unless ``OMP_WAIT_POLICY`` is set: a CPU run that shares its cores with other work
(another job, a test suite) otherwise loses the core its other threads need to threads spinning at a barrier. The
package's ``__init__`` loads no torch, so this comes before torch loads its OpenMP runtime.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import cg_lightning  # noqa: E402,F401  (importing the package registers the "cudagraph_ddp" strategy)
from cg_lightning.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
