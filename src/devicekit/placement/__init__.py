"""devicekit.placement"""
