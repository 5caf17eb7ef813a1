"""``python -m refserve.conformance.kernel_grid MODULE:FUNCTION ...``: the same as ``refserve
check-kernel``; the isolated worker is started this way (``--worker``)."""

import sys

from refserve.conformance.kernel_grid.cli import check_kernel_main

sys.exit(check_kernel_main(sys.argv[1:]))
