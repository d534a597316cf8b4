"""devicekit.examples"""
