"""How meshes, output, errors, timings and shardings look: text, HTML, rich and widgets."""
