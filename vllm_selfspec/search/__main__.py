"""``python -m vllm_selfspec.search ...`` is ``selfspec-profile ...``."""

import sys

from vllm_selfspec.profile_cli import main

sys.exit(main())
