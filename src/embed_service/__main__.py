import sys

from embed_service.cli import main

sys.exit(main())
