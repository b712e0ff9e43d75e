"""The parallelism planner: layouts of a model over a mesh, estimated on fake tensors, applied for real.

Runs in the notebook (enumerating and estimating candidates, in helper processes) and on the
ranks (building the model in a layout and training it); it needs torch and nothing of the mesh.
"""
