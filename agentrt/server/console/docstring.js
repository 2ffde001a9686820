// A program's docstring as the start form shows it: its first paragraph, the rest folded under a
// <details>. Prose paragraphs are reflowed (a docstring wraps its lines at a fixed width), list
// items keep their own lines, `code` spans are code; indented lines and drawings (box-drawing
// characters: a small ASCII graph of the program) keep their line breaks and spacing in a <pre>.
// Everything is put in as text, never as markup: a docstring cannot inject HTML.

import { el } from "./api.js";

const DRAWING = /[─━│┃└┘┌┐├┤┬┴┼╭╮╯╰═║→←↑↓▶◀]/;
const LIST_ITEM = /^\s*(?:[-*•]|\d+[.)])\s+/;

/** The text as blocks: {kind: "pre", lines} (indentation common to its lines removed) or
 * {kind: "p", lines} (a paragraph of prose; a list item starts a line of its own). */
export function docstringBlocks(text) {
  const blocks = [];
  let cur = null;
  for (const raw of String(text || "").replace(/\r\n?/g, "\n").split("\n")) {
    const line = raw.replace(/\s+$/, "");
    if (!line) { cur = null; continue; }
    const kind = /^\s/.test(line) || DRAWING.test(line) ? "pre" : "p";
    if (!cur || cur.kind !== kind) blocks.push(cur = { kind, lines: [] });
    cur.lines.push(line);
  }
  for (const b of blocks) {
    if (b.kind !== "pre") continue;
    const indent = Math.min(...b.lines.map((l) => l.match(/^\s*/)[0].length));
    b.lines = b.lines.map((l) => l.slice(indent));
  }
  return blocks;
}

/** The element showing a docstring (null for none): the first block, then the others folded. */
export function docstringView(text) {
  const blocks = docstringBlocks(text);
  if (!blocks.length) return null;
  const [first, ...rest] = blocks.map(renderBlock);
  const box = el("div", { class: "docstring" }, first);
  if (rest.length) {
    box.append(el("details", { class: "docstring-more" }, el("summary", {}, "More about this program"), ...rest));
  }
  return box;
}

function renderBlock(block) {
  if (block.kind === "pre") return el("pre", { class: "docstring-pre" }, block.lines.join("\n"));
  // Prose reflows; a list item begins a new line.
  const lines = [];
  for (const line of block.lines) {
    if (!lines.length || LIST_ITEM.test(line)) lines.push(line.trim());
    else lines[lines.length - 1] += " " + line.trim();
  }
  const p = el("p", {});
  lines.forEach((line, i) => {
    if (i) p.append(el("br"));
    p.append(...inlineCode(line));
  });
  return p;
}

// `code` spans as <code>, the rest as text.
function inlineCode(line) {
  return line.split(/(`[^`]+`)/).filter(Boolean)
    .map((part) => (part.length > 2 && part.startsWith("`") && part.endsWith("`") ? el("code", {}, part.slice(1, -1)) : part));
}
