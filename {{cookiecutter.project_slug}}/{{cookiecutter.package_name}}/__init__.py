"""{{ cookiecutter.project_name | docstring_text }}.

{{ cookiecutter.description | wordwrap(96) | docstring_text }}
"""

__version__ = "0.1.0"
