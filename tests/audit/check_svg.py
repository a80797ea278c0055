#!/usr/bin/env python3
"""Checks a picture the command drew: well-formed SVG (an XML parser reads it), a size, some
shapes, and the given texts present (a legend entry, a title).

  python3 tests/audit/check_svg.py FILE.svg [TEXT ...]
"""

import sys
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"


def main(argv):
    path, texts = argv[1], argv[2:]
    root = ET.parse(path).getroot()
    assert root.tag == NS + "svg", f"{path}: root is {root.tag}, not svg"
    assert float(root.get("width")) > 100 and float(root.get("height")) > 100, "no size"
    shapes = sum(1 for e in root.iter() if e.tag in (NS + "rect", NS + "circle", NS + "polygon",
                                                     NS + "line"))
    assert shapes >= 10, f"{path}: only {shapes} shapes"
    words = " ".join(e.text or "" for e in root.iter() if e.tag in (NS + "text", NS + "title"))
    for t in texts:
        assert t in words, f"{path}: no text {t!r}"
    print(f"ok {path}: {shapes} shapes")


if __name__ == "__main__":
    main(sys.argv)
