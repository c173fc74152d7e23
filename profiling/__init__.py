"""In-job profiling collectors and the fixed, versioned schema of per-rank step records."""

from profiling.schema import SCHEMA_VERSION, STEP_FIELDS  # noqa: F401
