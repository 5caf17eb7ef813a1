"""``python -m conformance.kernel_grid MODULE:FUNCTION ...``: the same as ``refserve
check-kernel``; the isolated worker is started this way (``--worker``)."""

import sys

from conformance.kernel_grid.cli import check_kernel_main

sys.exit(check_kernel_main(sys.argv[1:]))
