"""The page-reading script of ``web/browser-v0``: the DOM walk behind every observation.

``SNAPSHOT_JS`` runs in the page (``page.evaluate``) and returns ``{text, elements, title}``:
one line per heading, text block and interactive element, each interactive element numbered
``[id]`` with its role, accessible name, value and state. The numbers are written into the DOM
as ``data-envhub-id`` (earlier ones removed first), so an action on ``[id]`` finds exactly the
element the model saw.
"""

from __future__ import annotations

__all__ = ["SNAPSHOT_JS"]

SNAPSHOT_JS = r"""
() => {
  const lines = [], elements = [];
  let next = 0;
  const clean = (s) => (s || '').replace(/\s+/g, ' ').trim().slice(0, 100);
  const visible = (el) => {
    const s = getComputedStyle(el);
    return s.display !== 'none' && s.visibility !== 'hidden';
  };
  const roleOf = (el) => {
    if (el.getAttribute('role')) return el.getAttribute('role');
    const t = el.tagName;
    if (t === 'A') return 'link';
    if (t === 'BUTTON') return 'button';
    if (t === 'SELECT') return 'combobox';
    if (t === 'TEXTAREA') return 'textbox';
    const type = (el.getAttribute('type') || 'text').toLowerCase();
    const roles = {checkbox: 'checkbox', radio: 'radio', submit: 'button', button: 'button'};
    return roles[type] || 'textbox';
  };
  const nameOf = (el) => clean(el.getAttribute('aria-label')
      || (el.labels && el.labels.length ? el.labels[0].innerText : '')
      || el.getAttribute('placeholder') || (el.tagName === 'SELECT' ? '' : el.innerText)
      || el.getAttribute('name') || '');
  document.querySelectorAll('[data-envhub-id]')
    .forEach((el) => el.removeAttribute('data-envhub-id'));
  const walk = (node, depth) => {
    for (const child of node.childNodes) {
      if (child.nodeType === 3) {
        const text = clean(child.textContent);
        if (text && !child.parentElement.closest('a,button,label,select,textarea,option')) {
          lines.push('  '.repeat(depth) + 'text "' + text + '"');
        }
        continue;
      }
      if (child.nodeType !== 1 || !visible(child)) continue;
      if (['SCRIPT', 'STYLE', 'NOSCRIPT'].includes(child.tagName)) continue;
      const tag = child.tagName;
      const control = ['A', 'BUTTON', 'INPUT', 'SELECT', 'TEXTAREA'].includes(tag);
      if (control && !(tag === 'INPUT' && child.type === 'hidden')) {
        next += 1;
        child.setAttribute('data-envhub-id', String(next));
        const role = roleOf(child), name = nameOf(child);
        let line = '  '.repeat(depth) + '[' + next + '] ' + role + ' "' + name + '"';
        let value = '';
        if (role === 'checkbox' || role === 'radio') {
          line += child.checked ? ' checked' : ' unchecked';
        } else if (tag === 'SELECT') {
          value = child.selectedIndex >= 0 ? clean(child.options[child.selectedIndex].text) : '';
          const options = Array.from(child.options).map((o) => clean(o.text)).join(', ');
          line += ' value="' + value + '" options=[' + options + ']';
        } else if (tag === 'INPUT' || tag === 'TEXTAREA') {
          value = child.value;
          line += ' value="' + clean(value) + '"';
        }
        lines.push(line);
        elements.push({id: next, role: role, name: name, value: value, checked: !!child.checked});
        continue;
      }
      if (/^H[1-6]$/.test(tag)) {
        lines.push('  '.repeat(depth) + 'heading "' + clean(child.innerText) + '"');
        continue;
      }
      if (tag === 'LABEL') {
        const own = Array.from(child.childNodes).filter((n) => n.nodeType === 3);
        const text = clean(own.map((n) => n.textContent).join(' '));
        if (text && !child.control) lines.push('  '.repeat(depth) + 'text "' + text + '"');
      }
      walk(child, ['FORM', 'UL', 'NAV', 'MAIN', 'SECTION'].includes(tag) ? depth + 1 : depth);
    }
  };
  walk(document.body, 0);
  return {text: lines.join('\n'), elements: elements, title: document.title};
}
"""
