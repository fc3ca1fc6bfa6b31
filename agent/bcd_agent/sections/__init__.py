"""One package per NodeSpec section, each with a pure plan and an applier."""
