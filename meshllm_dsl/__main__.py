import sys

from meshllm_dsl.cli import main

sys.exit(main())
