import sys

from kernelcache.cli.main import main

sys.exit(main())
