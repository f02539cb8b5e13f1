"""One engine process (``drive``), run as ``python -m kernelcache.toolchains.vllm JOB``: the
package's module, whose state the runtime's hooks fill."""

import sys

from kernelcache.toolchains.vllm.engine import main

sys.exit(main(sys.argv[1:]))
