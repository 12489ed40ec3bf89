"""stepline.events"""
