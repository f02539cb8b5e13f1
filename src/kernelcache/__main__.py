import sys

from kernelcache.cli import main

sys.exit(main())
