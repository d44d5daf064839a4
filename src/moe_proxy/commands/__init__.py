"""One module per `moe-proxy` subcommand; see moe_proxy.cli.COMMANDS."""
