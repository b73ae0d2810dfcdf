"""bench constrained: tool calls and JSON under llguidance, outlines-core and lm-format-enforcer."""
