"""``python -m vllm_selfspec.profile ...`` is ``selfspec-profile ...`` (see profile_cli)."""

from vllm_selfspec.profile_cli import main

if __name__ == "__main__":
    import sys

    sys.exit(main())
