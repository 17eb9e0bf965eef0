"""Hidden-state capture: the SGLang forward hook, the reference engine, and the file format both write."""
