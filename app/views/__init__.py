"""Pure views: step records and plain values to plotly figures, SVG, HTML and text."""
