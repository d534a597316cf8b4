"""devicekit.parallel"""
