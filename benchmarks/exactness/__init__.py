"""bench exactness: how often a cached request's greedy answer differs, per dtype."""
