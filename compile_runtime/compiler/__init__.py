"""The compiler: ``@compile`` traces a model once; the graph compiler runs the passes, splits
the graph at attention and compiles each piece; the piecewise runtime picks a compiled
callable per token count."""
