"""The recipe: typed sections assembled in ``schema`` (``model``, ``parallel``, ``training``, ``data``,
``checkpoint``, ``cluster``, ``backend``, ``profiling``, ``tracking``, ``sweep``; each on ``base``'s strict
``Section``, field docs read by ``docstrings``), reading YAML (``yamlfile``, bounded; ``load``: overrides and
precedence; ``site``: the site file), cross-field rules (``rules``, the fields each reads found by ``reads``;
``noops`` refuses values that do nothing, knowing which layer wrote them from ``provenance``), what Transformer
Engine accepts (``te_support``), what each ``cluster.launcher`` is (``launchers``), the errors users read
(``pydantic_errors``, ``text``; other libraries' names for fields in ``aliases``) and the reference of
``validate --explain`` (``explain``, walking ``fields``)."""
