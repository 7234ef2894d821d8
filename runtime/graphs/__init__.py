"""Graph calls on a loaded artifact: step API, recurrent state, row exactness, verify trees, call costs."""
