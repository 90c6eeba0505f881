"""Other tools' formats: `meshc import-hf` (Hugging Face configs in) and `meshc export` (DTensor, tp_plan)."""
