"""The `lazarus` commands: each module registers its subcommands and holds their handlers."""
