"""The layers generated code calls, the unsharded reference model and generation."""
