"""Plain values shared by every process: errors, rank sets, shapes, layouts, text. Stdlib only."""
