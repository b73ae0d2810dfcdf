"""Tool calls and structured answers: formats, chat rendering and constrained decoding."""
