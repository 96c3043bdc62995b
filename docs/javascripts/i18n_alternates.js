// The two editions of a page point at each other with <link rel="alternate">
// (mkdocs-static-i18n writes the same page in the other language there).
// Material's bundle fetches a sitemap.xml beside every such link, which only
// exists at a site's root, so each page would log two failed requests. The
// language switcher in the header needs none of it: its links already lead
// to the same page in the other edition. Loaded before the bundle, this drops
// the head links before the bundle reads them.
document.querySelectorAll('link[rel="alternate"][hreflang]').forEach(link => link.remove());
