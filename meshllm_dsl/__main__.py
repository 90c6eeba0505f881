import sys

from meshllm_dsl.cli.main import main

sys.exit(main())
