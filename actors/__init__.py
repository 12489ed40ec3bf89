"""stepline.actors"""
