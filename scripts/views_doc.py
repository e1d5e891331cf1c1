"""Write docs/views.md from the headers of queries/*.sql (tests/test_core.py checks it is current).

    python scripts/views_doc.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from warehouse.query import views_reference  # noqa: E402

if __name__ == "__main__":
    (ROOT / "docs" / "views.md").write_text(views_reference())
    print(f"wrote {ROOT / 'docs' / 'views.md'}")
