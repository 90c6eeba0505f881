"""What a person reads about a checked plan: `meshc explain`, its pictures, and the profile report."""
