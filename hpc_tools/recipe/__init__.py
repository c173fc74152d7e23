"""The recipe: typed sections (``schema.Recipe``), reading and resolving YAML (``load``), cross-field rules (``rules``)."""
