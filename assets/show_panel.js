// Run in the page once the A/B panel opened (or not: a hidden panel does not scroll): it opened below the fold at
// 1440x900, with nothing to say so (issue 46); the next frame, once Gradio has shown it.
() => requestAnimationFrame(() =>
    document.querySelector('#ab-panel')?.scrollIntoView({block: 'nearest', behavior: 'instant'}))
