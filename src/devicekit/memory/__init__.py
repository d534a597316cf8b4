"""devicekit.memory"""
