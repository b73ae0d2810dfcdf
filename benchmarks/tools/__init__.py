"""bench tools: right answers out of N through each tool-calling route, per model."""
