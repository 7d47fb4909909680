"""{{ cookiecutter.project_name }}.

{{ cookiecutter.description | wordwrap(96) }}
"""

__version__ = "0.1.0"
