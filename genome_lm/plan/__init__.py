"""The hardware planner: memory of a training step per GPU and per node from a ``RunConfig``
(``memory_model``, ``activations``), tables and suggestions (``report``), the published run's
figures (``published``), measurement on this CPU (``measure``, ``sweep``); see docs/plan.md."""
