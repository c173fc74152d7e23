"""The recipe: typed sections (``schema.Recipe``), reading YAML (``load``), cross-field rules (``rules``)."""
