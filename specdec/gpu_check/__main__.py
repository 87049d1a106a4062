"""`python -m specdec.gpu_check`: see specdec/gpu_check/__init__.py."""

import sys

from specdec.gpu_check.runner import main

sys.exit(main())
