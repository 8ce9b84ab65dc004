from .target import cli

cli()
