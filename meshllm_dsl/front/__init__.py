"""The front end: source text -> tokens -> AST -> included files -> resolved meshes and models."""
