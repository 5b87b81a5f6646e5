"""`python -m sgl_lite` is the `sgl-lite` command."""

from sgl_lite.cli import main

main()
