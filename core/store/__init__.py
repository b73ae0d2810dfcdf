"""Where KV lives: memory, disk and shared (Redis) tiers, their codecs and keys."""
