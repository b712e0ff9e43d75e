/**
 * Keyed DOM updates: the panel re-renders twice a second while ranks are busy, and an
 * element replaced between a mouse press and its release loses the click. Only the parts
 * whose HTML changed are replaced; the rest (buttons above all) stay the same elements.
 */

/** A child element: a key (stable across renders) and its HTML (one element). */
export interface IPart {
  key: string;
  html: string;
}

/** A child element that holds parts of its own (a container is never replaced). */
export interface IContainer {
  key: string;
  tag: string;
  attributes: Record<string, string>;
  parts: (IPart | IContainer)[];
}

const rendered = new WeakMap<Element, string>();

function fromHtml(html: string): Element {
  const template = document.createElement('template');
  template.innerHTML = html.trim();
  return template.content.firstElementChild ?? document.createElement('span');
}

function isContainer(part: IPart | IContainer): part is IContainer {
  return (part as IContainer).parts !== undefined;
}

/** Make `parent`'s children match `parts`, in order, touching only what changed. */
export function patchChildren(parent: Element, parts: (IPart | IContainer)[]): void {
  const existing = new Map<string, Element>();
  for (const child of Array.from(parent.children)) {
    const key = child.getAttribute('data-key');
    if (key === null || existing.has(key)) {
      child.remove(); // not ours (a note shown in another state), or a duplicate
    } else {
      existing.set(key, child);
    }
  }
  const wanted = parts.map(part => {
    let el = existing.get(part.key);
    existing.delete(part.key);
    if (isContainer(part)) {
      if (!el || el.tagName.toLowerCase() !== part.tag) {
        const fresh = document.createElement(part.tag);
        el?.replaceWith(fresh);
        el = fresh;
      }
      el.setAttribute('data-key', part.key);
      for (const [name, value] of Object.entries(part.attributes)) {
        if (el.getAttribute(name) !== value) {
          el.setAttribute(name, value);
        }
      }
      patchChildren(el, part.parts);
    } else if (!el || rendered.get(el) !== part.html) {
      const fresh = fromHtml(part.html);
      fresh.setAttribute('data-key', part.key);
      rendered.set(fresh, part.html);
      el?.replaceWith(fresh);
      el = fresh;
    }
    return el;
  });
  existing.forEach(el => el.remove());
  wanted.forEach((el, i) => {
    if (parent.children[i] !== el) {
      parent.insertBefore(el, parent.children[i] ?? null);
    }
  });
}
