"""The `autohet` command. Each sub-command is a thin module: parse, call the library, print."""
